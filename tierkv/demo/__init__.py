"""`tierkv demo`, the main job: a whole node driven like an inference engine
(`engine`), reported as a table, JSON and a plot (`report`); `main` runs it."""

from tierkv.demo.command import main

__all__ = ["main"]

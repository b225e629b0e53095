"""The wire: every message of every link (`protocol`), the one socket factory
(`sockets`) and the eventfd that wakes a poll loop from another thread (`wakeup`)."""

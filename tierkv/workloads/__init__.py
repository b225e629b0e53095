"""Request streams in the Mooncake trace format: reading traces (`traces`) and
generating synthetic ones (`synthetic`). Used by the demo, the replay and the benches."""

"""Running a node: the config, the supervisor and its child lifetimes, `tierkv status`,
logging, and the local S3 endpoint of the embedded default."""

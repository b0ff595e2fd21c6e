"""Engine: the streaming merge pipeline, executors, shard writing and the publish transaction."""

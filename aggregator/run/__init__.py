"""Building and running the parts: the composition root, the daemon, cluster nodes, worker processes."""

"""One host's processes: the agent that starts, watches and replaces the workers, and the zygote they fork from."""

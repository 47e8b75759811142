"""The fault-tolerance library: fault-tolerant collectives, the step protocol, checkpoints of the training
state and the MeCeFO transform."""

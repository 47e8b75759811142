"""One host's processes: the agent (``agent``) that starts, watches and replaces the workers, a short loop over
its parts (``supervisor``: the workers; ``spares``: warm spares; ``faults``: the failure schedule's signals;
``processes``: starting processes and waiting on them; ``link``: its line to the coordinator), what the workers
run as its caller gives it (``command``), and the zygote they fork from (``zygote``)."""

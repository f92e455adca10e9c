"""Jobs: a config file's processes, built from the process registry (jobs.registry, jobs.job)."""

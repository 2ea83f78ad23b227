"""Running on many processes: the process group, gradient averaging, liveness, preemption, fault injection."""

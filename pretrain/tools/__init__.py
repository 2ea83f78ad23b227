"""Offline tools run beside training: the pre-flight report, the masked-LM probe, the frozen-state report."""

"""The distributed tests' process launcher: `launch.local.run_local` (shared with the benchmarks)."""

from launch.local import run_local as run_distributed

__all__ = ["run_distributed"]

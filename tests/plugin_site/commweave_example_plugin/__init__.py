"""An installed package's workload, found by commweave through its `commweave.workloads` entry point."""

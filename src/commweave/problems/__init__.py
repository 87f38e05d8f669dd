"""Bring your own problem: a PyTorch + torch.distributed program, judged and searched.

format (what a problem is; our files and ParallelKernelBench's read in place), values (arguments
and results as flat tensors), service (the trusted reference workers), program (a solution file
as a commweave program), workload (a problem as a `Workload`), judge (verdicts), suite (every
problem of a folder through the judge). docs/problems.md is the user's guide.
"""

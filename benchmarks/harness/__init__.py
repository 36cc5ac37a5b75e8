"""Pieces shared by the benchmarks: child processes, memory sampling, cgroup limits, rounds, reports, targets.

A scenario (``benchmarks/bench_*.py``) imports the modules it needs; none of them imports torch at module
level, so a parent process that only runs children stays free of it.

- ``protocol``: the child's side of the line protocol (JSON records on stdout, token clock)
- ``children``: spawn a child, collect its records, turn them into a row
- ``cpu``: how busy the other processes keep the CPUs, and waiting for them to go idle
- ``sampling``: a measured child's memory, at named moments and as sampled peaks; the import baseline
- ``measure``: one measured generation: a seeded prompt, warm-up, timed prefill and generate, timeline;
  batches of seeded prompts of different lengths, left-padded, timed as tokens per second
- ``cgroup``: cgroup v1 memory groups with a hard limit
- ``disk``: dropping the page cache, and the disk's read bound on decoding
- ``model``: the benchmark's Llama (config of a size, build once, facts, KV cache bytes, loading per mode)
- ``engine``: fxoffload_hf's figures of a model, through ``engine_of(model).report()``
- ``rounds``: interleaved rounds, the median run, medians of paired ratios
- ``report``: the table, the notes under it, the machine's facts, the JSON file
- ``targets``: ratios against their targets, printed and returned
"""

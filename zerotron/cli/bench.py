"""``zerotron bench comm|train|plan|context|generate|serve|paged|checkpoint``: dispatch to the benchmark modules."""
from __future__ import annotations

from .errors import fail

BENCH_USAGE = """usage: zerotron bench comm|train|plan|context|generate|serve|paged|checkpoint [options]

  comm    collective bandwidth (nccl-tests algbw/busbw) per op and message size
  train   training throughput of parallel layouts side by side (zerotron bench train --layouts dp,single)
  plan    the planner's predicted ranking vs a 'bench train' run (Spearman correlation)
  context sequence-length sweep of context parallelism: cp ring vs dp vs a2a, ring overlap (zerotron bench context)
  generate  batched generation throughput of inference layouts (zerotron bench generate --nproc 2)
  serve   continuous vs window batching of zerotron serve under staggered arrivals; with --checkpoint:
          zerotron serve vs transformers serve over HTTP (zerotron bench serve)
  paged   the paged KV cache: speculative decoding, prefix caching, preemption, KV waste (zerotron bench paged)
  checkpoint  what checkpoint checksums cost: save / hash / verify / load seconds (zerotron bench checkpoint)

Run 'zerotron bench <comm|train|plan|context|generate|serve|paged|checkpoint> --help' for the options of one benchmark.
"""


def cmd_bench(argv: list[str]) -> int:
    if argv and argv[0] in ("-h", "--help", "help"):
        print(BENCH_USAGE)
        return 0
    if argv and argv[0] == "generate":
        from ..bench.generate import main as generate_bench_main

        return generate_bench_main(argv[1:])
    if argv and argv[0] == "serve":
        from ..bench.serve import main as serve_bench_main

        return serve_bench_main(argv[1:])
    if argv and argv[0] == "paged":
        from ..bench.paged import main as paged_bench_main

        return paged_bench_main(argv[1:])
    if argv and argv[0] == "context":
        from ..bench.context import main as context_bench_main

        return context_bench_main(argv[1:])
    if argv and argv[0] == "checkpoint":
        from ..bench.checkpoint import main as checkpoint_bench_main

        return checkpoint_bench_main(argv[1:])
    if not argv or argv[0] not in ("comm", "train", "plan"):
        return fail("usage: zerotron bench comm|train|plan|context|generate|serve|paged|checkpoint [options] (see 'zerotron bench comm --help'); "
                     "'bench plan' checks the planner's ranking against a 'bench train' run")
    if argv[0] == "comm":
        from ..bench.comm import main as comm_main

        return comm_main(argv[1:])
    if argv[0] == "plan":
        from ..bench.validate_plan import main as validate_main

        return validate_main(argv[1:])
    from ..bench.train import main as train_bench_main

    return train_bench_main(argv[1:])

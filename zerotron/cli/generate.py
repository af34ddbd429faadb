"""``zerotron generate``: sample text from a checkpoint, in this process or over ``--nproc`` workers."""
from __future__ import annotations

import argparse

from ..cli_help import HelpFormatter, OneLineErrorParser
from ..config_checks import MAX_NEW_TOKENS
from ..launch import strip_nproc
from ..models.layout import ep_inference_refusal, tp_refusal
from .errors import fail, user_errors


def generate_parser() -> argparse.ArgumentParser:
    """The argument parser of ``zerotron generate``."""
    p = OneLineErrorParser(prog="zerotron generate", formatter_class=HelpFormatter,
                                description="Generate text from a checkpoint.")
    p.add_argument("--checkpoint", required=True, help="a run directory (newest checkpoint) or checkpoints/step_N")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--prompt", help="prompt text")
    g.add_argument("--prompts-file", help="one prompt per line; spread over data-parallel ranks with --nproc")
    p.add_argument("--max-new-tokens", type=int, default=100, help=f"tokens to generate after each prompt (at most {MAX_NEW_TOKENS:,})")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (deterministic)")
    p.add_argument("--top-k", type=int, default=None, help="sample from the k most likely tokens (default: all)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: the most likely tokens of mass p")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (prompt i: seed + i)")
    p.add_argument("--nproc", type=int, default=0,
                   help="N local processes (data parallel over prompts, x tp x pp; 0 = this process alone)")
    p.add_argument("--parallel.tp", dest="tp", type=int, default=1, help="tensor-parallel degree")
    p.add_argument("--parallel.pp", dest="pp", type=int, default=1, help="pipeline-parallel degree")
    p.add_argument("--microbatches", type=int, default=0, help="pipeline micro-batches in flight (0 = pp)")
    p.add_argument("--adapter", default="", help="a peft LoRA adapter directory (adapter_config.json + "
                   "adapter_model.safetensors) folded into the checkpoint's weights")
    p.add_argument("--parallel.ep", dest="ep", type=int, default=1,
                   help="expert-parallel degree (mixture-of-experts models: each of ep ranks holds E/ep experts)")
    p.add_argument("--ep-split", choices=("replica", "tokens"), default="replica",
                   help="how an ep group shares decoding: replica (its ranks decode the same rows, outputs all-gathered) or tokens (each rank its own rows, tokens sent to their experts by all-to-all)")
    p.add_argument("--compile", action="store_true",
                   help="compile the decode step with static shapes (batch and KV length buckets; single "
                        "process and data parallel; the first batch of each bucket compiles)")
    return p


def cmd_generate(argv: list[str]) -> int:
    args = generate_parser().parse_args(argv)
    from ..generate import generate_main
    from ..launch import launch
    from ..launch_worker import in_worker

    try:
        if args.nproc < 0:
            raise ValueError(f"--nproc must be >= 0 (0 or 1: this process alone), got {args.nproc}")
        if args.max_new_tokens > MAX_NEW_TOKENS:  # before any checkpoint is read
            raise ValueError(f"--max-new-tokens {args.max_new_tokens} is more than {MAX_NEW_TOKENS:,}, the most one "
                             f"prompt may ask for (past the model's context, block_size, each new token recomputes "
                             f"the whole window): ask for fewer")
        if args.adapter and not in_worker():  # one line before any worker or weight is loaded
            from ..generate import check_adapter

            check_adapter(args.checkpoint, args.adapter)
        if args.nproc > 1 and not in_worker():
            from ..data import load_tokenizer
            from ..generate import check_sampling_args, read_prompts, resolve_checkpoint
            from ..train.checkpoint import read_meta

            check_sampling_args(args)
            ckpt_dir = resolve_checkpoint(args.checkpoint)
            model_cfg = read_meta(ckpt_dir).get("model_config", {})
            read_prompts(args, load_tokenizer(ckpt_dir / "tokenizer.json"))  # fail once, before the workers
            for name, value in (("--parallel.tp", args.tp), ("--parallel.pp", args.pp)):
                if value < 1:
                    raise ValueError(f"{name} must be >= 1, got {value}")
            if args.nproc % (args.tp * args.pp):
                raise ValueError(f"--nproc {args.nproc} must be a multiple of --parallel.tp x --parallel.pp "
                                 f"({args.tp} x {args.pp})")
            reason = tp_refusal(args.tp, model_cfg, tp_name="--parallel.tp")  # the rule the plan applies
            if reason:
                raise ValueError(reason)
            reason = ep_inference_refusal(args.ep, args.nproc, args.tp, args.pp, model_cfg, split=args.ep_split)
            if reason:
                raise ValueError(reason)
            if args.compile:
                from ..inference.compiled import compile_refusal
                reason = compile_refusal(args.tp, args.pp, args.ep)
                if reason:
                    raise ValueError(reason)
            return launch(args.nproc, ["generate", *strip_nproc(argv)])
        return generate_main(args)
    except user_errors() as e:
        return fail(str(e))
    except ValueError as e:
        return fail(str(e))

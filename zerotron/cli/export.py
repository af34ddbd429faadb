"""``zerotron export``: a checkpoint of any layout as a Hugging Face directory."""
from __future__ import annotations

import argparse
from pathlib import Path

from ..cli_help import HelpFormatter, OneLineErrorParser
from .errors import fail, user_errors


def export_parser() -> argparse.ArgumentParser:
    """The argument parser of ``zerotron export``."""
    p = OneLineErrorParser(prog="zerotron export", formatter_class=HelpFormatter, description="Export a "
                                "checkpoint of any layout as a Hugging Face directory (config.json + "
                                "model.safetensors): GPT2LMHeadModel or LlamaForCausalLM, by the model's family.")
    p.add_argument("--checkpoint", required=True, help="a run directory (newest checkpoint) or checkpoints/step_N")
    p.add_argument("--out", required=True, help="output directory (must not exist or be empty)")
    p.add_argument("--overwrite", action="store_true", help="replace the files of a non-empty --out")
    p.add_argument("--adapter", default="", help="a LoRA run (GPT-2 or Llama): write --out as the base model (adapters not "
                                                 "merged) and this directory as a peft adapter (adapter_config.json + "
                                                 "adapter_model.safetensors); without it a LoRA run is exported merged")
    return p


def _split_adapter(model, meta: dict, args):
    """``--adapter``: the adapters' peft state and config, removed from ``model`` (which becomes
    the unmerged base). Raises ValueError (one line) for a checkpoint without adapters or a
    family other than GPT-2 and Llama."""
    from ..models import registry
    from ..models.lora import adapter_state, has_lora, lora_kwargs, lora_modules, peft_config

    if not has_lora(model):
        raise ValueError(f"--adapter: the checkpoint {args.checkpoint!r} has no LoRA adapters (trained with "
                         "train.lora_rank = 0), so there is no adapter to write for a base; export it without --adapter")
    arch = registry.arch_of(model)
    if arch not in ("gpt2", "llama"):
        raise ValueError(f"--adapter writes peft adapters for GPT-2 and Llama models, not {arch}; export the merged "
                         "model without --adapter")
    kw = lora_kwargs(meta["config"]["train"])
    # GPT-2: HF's layers are Conv1D (weight (in, out)); peft keeps A (r, in), B (out, r) and marks
    # them fan_in_fan_out; c_attn's output columns are [q | k | v] as in zerotron's fused Linear
    state = adapter_state(model)
    config = peft_config(model, kw["rank"], kw["alpha"], kw["dropout"], fan_in_fan_out=arch == "gpt2")
    for m in lora_modules(model).values():  # the base: adapters removed, weights as trained (frozen)
        m.lora_handle.remove()
        del m.lora_A, m.lora_B
    return state, config


def _check_not_the_run(args) -> None:
    """Refuse (ValueError, one line) an ``--out``/``--adapter`` that is the run directory of the
    checkpoint being exported, its step directory or a folder inside its ``checkpoints/``: with
    ``--overwrite`` the export's config.json, tokenizer.json ... replaced the run's own (the run's
    training config.json was lost)."""
    from ..generate import resolve_checkpoint

    step = resolve_checkpoint(args.checkpoint).resolve()
    run = step.parent.parent if step.parent.name == "checkpoints" else None
    for flag, out in (("--out", args.out), ("--adapter", args.adapter)):
        if not out:
            continue
        o = Path(out).resolve()
        if o == step or o == run or (run is not None and o.is_relative_to(run / "checkpoints")) \
                or o.is_relative_to(step):
            what = "the run directory" if o == run else "inside the checkpoint"
            raise ValueError(f"{flag} {out!r} is {what} of {args.checkpoint!r}: its config.json and tokenizer "
                             f"files would be replaced by the export's; choose another {flag} directory "
                             f"(e.g. {str(Path(out) / 'hf') if o == run else 'a new folder'})")


def _nbytes(state: dict) -> int:
    """Bytes of the tensors of ``state`` (tied ones counted once, as safetensors writes them): what an
    export needs on disk, about (the JSON and tokenizer files are small beside it)."""
    return sum(t.numel() * t.element_size() for t in {id(t): t for t in state.values()}.values())


def _write_adapter(out_dir: Path, state: dict, config: dict, base: str) -> None:
    """Write ``adapter_config.json`` and ``adapter_model.safetensors`` into ``out_dir`` (a staging
    directory, :func:`staging.staged_dir`)."""
    import json

    from safetensors.torch import save_file

    save_file(state, str(out_dir / "adapter_model.safetensors"), metadata={"format": "pt"})
    (out_dir / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": base}, indent=2) + "\n")


def cmd_export(argv: list[str]) -> int:
    args = export_parser().parse_args(argv)
    from .staging import check_out_dir, staged_dir, write_failure

    try:
        check_out_dir(args.out, args.overwrite)  # before any weight is read
        _check_not_the_run(args)
        if args.adapter:
            check_out_dir(args.adapter, args.overwrite, "--adapter")
        import torch
        from safetensors import SafetensorError  # what its writer raises on a full disk (not an OSError)

        from ..data.tokenizer import read_special_tokens, write_special_files
        from ..distributed import mesh
        from ..generate import load_model
        from ..models.registry import export_hf

        owned = not torch.distributed.is_initialized()
        mesh.init_distributed(timeout_s=600, device=torch.device("cpu"))
        from ..generate import resolve_checkpoint

        model, tok, meta = load_model(args.checkpoint, torch.device("cpu"), merge=not args.adapter)
        specials = read_special_tokens(resolve_checkpoint(args.checkpoint), tok)  # the checkpoint's own
        adapter = _split_adapter(model, meta, args) if args.adapter else None
        out = Path(args.out)
        needed = {"--out": _nbytes(model.state_dict()), "--adapter": _nbytes(adapter[0]) if adapter else 0}
        target = (args.out, "--out")
        try:  # every file goes to staging directories first: a full disk leaves --out (and --adapter) as it was
            with staged_dir(out, args.overwrite) as tmp:
                export_hf(model, tmp, eos_token_id=specials.eos_id)
                tok.save(str(tmp / "tokenizer.json"))
                write_special_files(tmp, specials)  # bos/eos/pad ids (every stop id) and the chat template
                if adapter is not None:
                    target = (args.adapter, "--adapter")
                    with staged_dir(args.adapter, args.overwrite, "--adapter") as atmp:
                        _write_adapter(atmp, *adapter, base=str(out.resolve()))
                target = (args.out, "--out")
        except FileExistsError:
            raise
        except (OSError, SafetensorError) as e:  # ENOSPC, EIO, a read-only file system: the staging directories are gone
            return fail(write_failure(target[0], e, target[1], needed=needed[target[1]]))
        if owned:
            mesh.teardown()
        files = ", ".join(sorted(p.name for p in out.iterdir() if p.is_file()))
        print(f"wrote {out}: {files} (transformers: AutoModelForCausalLM.from_pretrained({str(out)!r}), "
              f"PreTrainedTokenizerFast(tokenizer_file={str(out / 'tokenizer.json')!r}))")
        if adapter is not None:
            print(f"wrote {args.adapter}: adapter_config.json, adapter_model.safetensors (peft: "
                  f"PeftModel.from_pretrained(base, {args.adapter!r}))")
        return 0
    except user_errors() as e:
        return fail(str(e))
    except ValueError as e:
        return fail(str(e))

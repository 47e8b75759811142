"""``unbroken export RUN_DIR OUT``: a run's last good checkpoint as a Hugging Face ``save_pretrained`` folder
with its tokenizer (the built-in LLaMA's weights renamed by ``hf.to_hf_state_dict``; a Hugging Face model's
saved as they are)."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from unbroken.core.config import RunConfig, config_from_toml_text
from unbroken.train.hf import hf_config_of, to_hf_state_dict, transformers_lib


def export(run_dir: Path, out: Path) -> Path:
    """Write the run's last good checkpoint as a Hugging Face ``save_pretrained`` folder (with the tokenizer).

    Raises:
        ValueError: RUN_DIR has no usable checkpoint, is a script's run (its model is the script's own), or OUT
            exists and is not empty.
    """
    from unbroken.data.corpus import open_corpus
    from unbroken.ft.checkpoint import schema as ckpt
    from unbroken.train.trainer import build_model, model_args_of

    if out.exists() and any(out.iterdir()):
        raise ValueError(f"export: {out} exists and is not empty; choose another folder")
    loaded = ckpt.load_latest(run_dir, log_rejections=False)
    if loaded is None:
        raise ValueError(f"export: {run_dir} has no usable checkpoint")
    if "model" not in loaded.state["metadata"]:  # what the built-in trainer records; a script's run has its own
        raise ValueError(
            f"export: {run_dir} is a run of a script's own model (unbroken launch), which export cannot rebuild; it "
            f"converts runs of unbroken train; your model's state_dict is unbroken.ft.checkpoint.schema.load_latest("
            f"RUN_DIR).state['model'] (checkpoint {loaded.path.name})"
        )
    cfg: RunConfig = config_from_toml_text(
        str(loaded.state["metadata"].get("config") or (run_dir / "config.toml").read_text())
    )
    corpus = open_corpus(cfg.data)
    if cfg.model.hf_config:
        with torch.device("meta"):
            model = build_model(cfg, corpus.vocab_size)
        model = model.to_empty(device="cpu")
        model.load_state_dict(loaded.state["model"])
    else:
        args = model_args_of(cfg, corpus.vocab_size)
        model = transformers_lib().LlamaForCausalLM(hf_config_of(args))
        model.load_state_dict(to_hf_state_dict(loaded.state["model"], args))
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(str(tmp))
    if corpus.tokenizer_path is not None:  # (foreign prepared ids may come without their tokenizer)
        shutil.copyfile(corpus.tokenizer_path, tmp / "tokenizer.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.exists():
        out.rmdir()
    tmp.rename(out)
    return out

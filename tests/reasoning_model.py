"""A reasoning-model variant of the bundled model, for the reasoning parser's tests: the same
weights, a tokenizer in which `<think>` and `</think>` are single tokens (as in DeepSeek-R1's and
V3.1's tokenizers) and a chat template that opens the reasoning block, or closes it when the
request passes `chat_template_kwargs={"thinking": false}` (V3.1's switch).

The marker tokens take the ids of the bundled BPE's two last merges ("let", "UR"): those merges
are dropped, so text never encodes to them, and the ids decode to the markers.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

BUNDLED = Path(__file__).resolve().parents[1] / "models" / "splash-tiny"
THINK, END_THINK = "<think>", "</think>"
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% if thinking is defined and not thinking %}</think>"
    "{% else %}<think>{% endif %}{% endif %}"
)


def make_reasoning_model(folder: Path) -> Path:
    """Write the variant into `folder` (weights linked, not copied) and return it."""
    folder.mkdir(parents=True, exist_ok=True)
    for f in BUNDLED.iterdir():
        if f.suffix == ".safetensors" or f.name in ("config.json", "training.json"):
            target = folder / f.name
            if not target.exists():
                os.symlink(f, target)
    tok = json.loads((BUNDLED / "tokenizer.json").read_text())
    model = tok["model"]
    by_id = {i: s for s, i in model["vocab"].items()}
    last = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"][-2:]]
    ids = [model["vocab"]["".join(pair)] for pair in last]
    model["merges"] = model["merges"][:-2]
    for token_id, content in zip(ids, (THINK, END_THINK)):
        del model["vocab"][by_id[token_id]]
        model["vocab"][content] = token_id
        tok["added_tokens"].append({"id": token_id, "content": content, "single_word": False, "lstrip": False,
                                    "rstrip": False, "normalized": False, "special": False})
    (folder / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False))
    config = json.loads((BUNDLED / "tokenizer_config.json").read_text())
    config["chat_template"] = TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False))
    return folder

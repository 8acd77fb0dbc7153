"""The ingress process loads no model code: it needs the tokenizer, not the weights."""

from __future__ import annotations

import json
import subprocess
import sys

MODEL_CODE = ("workers.model_loader", "workers.lora.adapter", "workers.engine",
              "transformers.modeling_utils")


def test_the_ingress_imports_no_model_loading_code():
    # A fresh interpreter: this one has imported everything the other tests needed.
    probe = ("import json, sys, cluster.ingress_deployment; "
             f"print(json.dumps([m for m in {MODEL_CODE!r} if m in sys.modules]))")
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         timeout=120, check=True)
    assert json.loads(run.stdout.splitlines()[-1]) == []

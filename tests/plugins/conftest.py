"""The plugins' tests, one folder a plugin (as plugins/ is laid out), and the tests of what
several plugins share at this level.

Four folders need a venv of their own and are left out of a run elsewhere: by their paths
here (`collect_ignore`, relative to this file), not by pyproject's `norecursedirs`, which
matches folder names anywhere in the tree. The Nemotron plugin's tests are split by venv:
nemotron/ loads the model (torch, NeMo), nemotron_plugin/ is its contract layer, which
imports neither and runs in the main venv with the rest of the suite."""

import importlib.util

collect_ignore = []
# vllm/ needs vLLM, which lives in its own venv (`make test-vllm`)
if not importlib.util.find_spec("vllm"):
    collect_ignore.append("vllm")
# moshi/ needs torch and kyutai's moshi, which live in their own venv (`make test-moshi`)
if not importlib.util.find_spec("moshi"):
    collect_ignore.append("moshi")
# nemotron/ needs torch and nemo-toolkit, which live in their own venv (`make test-nemotron`)
if not importlib.util.find_spec("nemo"):
    collect_ignore.append("nemotron")
# minicpmo/ needs torch and transformers (its building blocks), which live in its own venv
# (`make test-minicpmo`)
if not (importlib.util.find_spec("torch") and importlib.util.find_spec("transformers")):
    collect_ignore.append("minicpmo")

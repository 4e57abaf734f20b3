"""Adapters that put a framework's own training loop under the runtime.

Each module meets one framework at its public seams and imports it; nothing in the core
imports this package (the import-linter contract in pyproject.toml keeps it so), so
`import resilient` never needs transformers or lightning.

- `resilient.integrations.hf`: the Hugging Face `Trainer` (`from resilient.integrations.hf
  import Trainer`).
- `resilient.integrations.lightning`: Lightning's Trainer (`callbacks=[Resilient()]`, from
  `resilient.integrations.lightning import Resilient`).
"""

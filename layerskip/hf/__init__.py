"""What layerskip knows of Hugging Face model internals: where a model's layers and sublayers are
and how to bypass them (``adapters``), the rollback KV cache in transformers' Cache API
(``cache``), forwards with explicit positions (``forward``), loading (``models``) and prompts to
ids (``prompting``). Nothing here imports the rest of layerskip but its errors."""

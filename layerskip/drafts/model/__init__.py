"""The draft model and its copies: the model as the draft runs it (``draft_model``: bypassed
sublayers, kept projections), the low-precision copies of those projections (``precision``), its
LM head and vocabulary ranking (``head``, ``vocab``) and trained exit adapters (``exit_adapter``)."""

"""The rules that price and shape proposals, without a model: what drafting costs and the tokens a
draft buys (``costs``), draft length by cost (``draft_length``), the token tree (``token_tree``)
and its shape by expected tokens per second (``tree_shape``)."""

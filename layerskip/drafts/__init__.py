"""Everything a draft is: the policy that describes it, the draft model (bypassed sublayers, kept
projections in bf16/int8/int4), its head and vocabulary, each drafter (skip, lookup, hybrid,
exit, on-the-fly) and the draft length rules. ``builder`` is the one way from a policy to a
drafter."""

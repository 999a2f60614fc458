"""Everything a draft is: four groups and two faces, each importing only those before it.

* ``model``: the draft model and its copies (bypassed sublayers, bf16/int8/int4 projections, its
  head and vocabulary ranking, exit adapters);
* ``rules``: what drafting costs and how proposals are priced and shaped (draft length, token trees);
* ``base``: the drafter interface the engine steps with (a face);
* ``policy``: the policy file and the argument that names one;
* ``drafters``: skip, lookup and the hybrid, exit, on-the-fly, siblings, ``auto``;
* ``builder``: the one way from a policy to a drafter, and what the engine needs of the rest (a face).

tests/test_layout.py holds the order.
"""

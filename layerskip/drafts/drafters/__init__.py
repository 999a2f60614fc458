"""The drafters, each behind ``drafts.base.Drafter``: the skip draft (``skip``), prompt lookup and
the hybrid (``lookup``), the exit draft (``exit_draft``), on-the-fly selection (``onthefly``),
siblings (``branching``) and ``auto`` (``auto``: the priced choice among them, and the prices a
batch's steps are chosen by)."""

"""The decode loop (draft, roll back, verify, accept), its acceptance rules' use, and CPU thread
tuning. It uses drafts through the ``drafts.base.Drafter`` interface and ``drafts.builder``."""

"""The policy: what a draft is told to do (``skip_policy``: ``SkipPolicy`` and its settings, the
JSON file and its checks) and the ``--policy`` / ``skip_policy=`` argument that names one (``spec``)."""

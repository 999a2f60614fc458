"""What runs at generation time: the decode loop, drafters, sampling, the rollback cache,
forward passes, skip policies, the draft vocabulary and generation statistics."""

"""Mixture-of-experts blocks under expert parallelism: finding the experts, dispatching tokens, load and balance."""

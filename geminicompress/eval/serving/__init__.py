"""Serving: the serve-bench table, its workload, the transformers serving loop, the serving figures."""

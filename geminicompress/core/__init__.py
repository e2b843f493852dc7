"""The ground floor: what every layer of the package shares (architecture table, quantization grid,
metrics, config bases). Imports nothing above it."""

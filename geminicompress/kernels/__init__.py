"""Runtime modules that execute compressed weights (int8, int4 packing and matmuls)."""

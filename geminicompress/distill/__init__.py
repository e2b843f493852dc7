"""Knowledge distillation of a teacher into a smaller student (accelerate training loop)."""

"""Side effects on the GPUs and daemons behind prepared claims, and the locks and binaries they need."""

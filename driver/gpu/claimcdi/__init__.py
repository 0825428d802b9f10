"""What goes into a claim's CDI spec: device nodes, the toolkit's driver libraries, MPS client edits."""

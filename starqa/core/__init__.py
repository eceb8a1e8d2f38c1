"""What every part of starqa stands on: its errors, its folders, the progress protocol,
the block plan, safetensors files read by hand, a paused garbage collector."""

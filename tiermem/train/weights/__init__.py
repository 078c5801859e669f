"""Working weights off the device or sharded over ranks, frozen weights, buffers, and where first values come from."""

"""The coordinator: the job's membership loop and the judges it consults."""

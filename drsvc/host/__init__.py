"""Typed wrappers over host facilities: loop devices, filesystems, mounts, reflink."""

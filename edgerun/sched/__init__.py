"""Scheduling: how edgerun shares the machine with other processes (threads, placement)."""

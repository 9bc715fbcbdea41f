"""Flash offloading ("LLM in a flash", issue 10): FFN neurons live on storage.

io.py reads byte ranges with direct I/O so offloaded weights never settle in the page
cache (a RAM budget counts it); bundle.py writes and reads the bundled layout, one
record per neuron (up row + down column), with the gate rows in a section of their own.
"""

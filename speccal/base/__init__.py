"""The ground floor: errors, small value types (geometry) and atomic file IO.

Imports nothing else of speccal; every other package may import it.
"""

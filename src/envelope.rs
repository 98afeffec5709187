//! SPYC envelope (DESIGN.md §3.1).

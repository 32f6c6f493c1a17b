"""Reference models built on the library, each with a bespoke and a manager-backed path.

Imported lazily: `import sessionstate` does not import this package (or diffusers).
"""

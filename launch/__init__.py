"""What `python app.py` does, one job per module: `options` reads the command line, `lineup`
starts (or connects to) the engines it names, `dictation` starts the Whisper engine beside them,
`web` assembles the UI and the API into one FastAPI app, `serve` runs it. Like app.py, never
imports torch before the options are read (and never, with --backend)."""

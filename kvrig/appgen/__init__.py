"""App generation: render templates/swift into an Xcode project (render.py), build it on macOS (build.py)."""

"""The device lab: a matrix of app × bundle × scheme soaked on every selected phone, as CI.

One module per job: `targets` selects the phones (on one or several usbmuxd hosts, narrowed by `--shard` and
`--devices`), `predict` attaches the planner's prediction, `schedule` lays out the runs and drives one worker
process per phone, `worker` is that process (the runs on one phone, one after another), `threshold` is the
main run and the threshold search after a jetsam, `save` writes results.json and junit.xml after every run,
`merge` joins the folders that shards of one lab wrote.

Layout: OUT/results.json, OUT/junit.xml, OUT/report.html, OUT/report/*.png,
OUT/runs/<udid>/<entry>/<scheme>/{main,confirm-N}/ (each a soak output folder).
"""

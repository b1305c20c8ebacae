"""house_arrest: vends an installed app's data container over AFC.

The first message is a plist command: VendContainer (the whole container) or VendDocuments (only
/Documents is reachable). An unknown bundle id gets "ApplicationLookupFailed", as on a phone.
"""

from __future__ import annotations

from kvrig.virtual.afc import AfcRoot, serve_afc
from kvrig.virtual.phone import Link


async def serve_house_arrest(link: Link) -> None:
    state = link.device.state
    request = await link.recv_plist()
    command = request.get("Command")
    bundle_id = str(request.get("Identifier", ""))
    if command not in ("VendContainer", "VendDocuments"):
        await link.send_plist({"Error": "InvalidCommand"})
        return
    if bundle_id not in state.user_apps():
        await link.send_plist({"Error": "ApplicationLookupFailed"})
        return
    await link.send_plist({"Status": "Complete"})
    allowed = "/Documents" if command == "VendDocuments" else "/"
    await serve_afc(link, AfcRoot(state.container(bundle_id), allowed=allowed))

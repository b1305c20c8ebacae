"""com.apple.amfi.lockdown: Developer Mode (iOS 16+).

One plist request per connection, `{"action": N}`: 0 reveals the Settings toggle, 1 asks to enable Developer
Mode (the phone restarts to apply it: every connection drops, the phone leaves usbmuxd and comes back, and
the developer disk image is no longer mounted), 2 confirms the prompt after the restart. The reply is
`{"success": true}` or `{"Error": "..."}`. The state itself is read through lockdownd (domain
`com.apple.security.mac.amfi`, key `DeveloperModeStatus`) or the image mounter.
"""

from __future__ import annotations

from kvrig.virtual.phone import Link

REVEAL, ENABLE, ACCEPT = 0, 1, 2


async def serve_amfi(link: Link) -> None:
    device = link.device
    request = await link.recv_plist()
    action = request.get("action")
    developer = device.state.developer()
    if action == REVEAL:
        await link.send_plist({"success": True})
    elif action == ENABLE:
        await link.send_plist({"success": True})
        if not developer.developer_mode:
            developer.developer_mode = True
            device.state.save_developer(developer)
            device.schedule_reboot()
    elif action == ACCEPT:
        if developer.developer_mode:
            await link.send_plist({"success": True})
        else:
            await link.send_plist({"Error": "Developer Mode is not pending confirmation"})
    else:
        await link.send_plist({"Error": f"unknown action {action!r}"})

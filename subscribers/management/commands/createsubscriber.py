"""createsubscriber NAME [--publish QUEUE ...] [--subscribe QUEUE ...] [--webhook URL] [--json]

The token is printed alone on the last line of stdout, so scripts can take it with `tail -n1`.
Like createqueue it may be run again: an existing subscriber is set as the command says (its
subscriptions and webhook secret kept) and gets a new token, since only a hash of the old is
kept; the old token stops working. With --webhook it prints the webhook secret, as the API
promises, made new only the first time (`rotatewebhooksecret NAME` makes another): whoever runs
manage.py reads the database anyway. The admin, where staff may only view, shows it just once.
"""

from django.core.exceptions import ValidationError
from django.core.management.base import CommandError

from mqsite.commands import ReportCommand
from subscribers.provisioning import ALL, UnknownQueues, provision_subscriber


class Command(ReportCommand):
    help = (
        "Make a subscriber, or set an existing one as given, and print a new API token (shown "
        "this once) on the last line."
    )
    json_help = (
        'print {"subscriber", "created", "publish": [...], "subscribe": [...], "webhook_secret", "token"}'
    )

    def add_arguments(self, parser):
        parser.add_argument("name")
        parser.add_argument(
            "--publish",
            nargs="+",
            action="extend",
            default=[],
            metavar="QUEUE",
            help=f"queues it may publish to ('{ALL}': every queue); may repeat",
        )
        parser.add_argument(
            "--subscribe",
            nargs="+",
            action="extend",
            default=[],
            metavar="QUEUE",
            help=f"queues it may subscribe to ('{ALL}': every queue); may repeat",
        )
        parser.add_argument("--webhook", default="", metavar="URL", help="POST its deliveries here")

    def report(self, *args, **options):
        try:
            subscriber, token, created, webhook_secret = provision_subscriber(
                options["name"],
                publish=options["publish"],
                subscribe=options["subscribe"],
                webhook_url=options["webhook"],
                update=True,
            )
        except UnknownQueues as exc:
            raise CommandError(f"unknown queue(s): {exc}") from None
        except ValidationError as exc:
            raise CommandError(
                "; ".join(f"{field}: {' '.join(m)}" for field, m in exc.message_dict.items())
            ) from None
        if not created:
            self.note(f"{subscriber.name} existed: it has a new token, and its old one no longer works")
        return {
            "subscriber": subscriber.name,
            "created": created,
            "publish": _scope(options["publish"]),
            "subscribe": _scope(options["subscribe"]),
            "webhook_secret": (webhook_secret or subscriber.webhook_secret) if options["webhook"] else None,
            "token": token,
        }

    def render(self, result):
        scope = {kind: ", ".join(result[kind]) or "none" for kind in ("publish", "subscribe")}
        self.say(
            f"{'created' if result['created'] else 'updated'} subscriber {result['subscriber']} "
            f"(publish: {scope['publish']}; subscribe: {scope['subscribe']})"
        )
        if result["webhook_secret"]:
            self.stdout.write(f"webhook secret: {result['webhook_secret']}")
        self.stdout.write(result["token"])  # even at -v 0: what the command is for


def _scope(names):
    if ALL in names:
        return [ALL]
    return sorted({n.lower() for n in names})

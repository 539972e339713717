# Push jobs with Ruby Sidekiq's own client (6.4.1 API), for interop tests.
#
#   REDIS_URL=redis://127.0.0.1:PORT/0 ruby push.rb CLASS QUEUE ARGS_JSON [--at EPOCH] [--retry N]
#       pushes one job, prints its jid
#   REDIS_URL=... ruby push.rb CLASS QUEUE IGNORED --bulk N [--at EPOCH]
#       push_bulk of N jobs with args [0], [1], ... [N-1], prints one jid a line
#
# Sidekiq reads the Redis URL from REDIS_URL by itself. The class is passed as
# a String, so no Ruby class of that name needs to exist here.
require "json"
require "optparse"
require "sidekiq"

at = nil
bulk = nil
retry_option = nil
parser = OptionParser.new do |o|
  o.banner = "usage: push.rb CLASS QUEUE ARGS_JSON [--at EPOCH] [--bulk N]"
  o.on("--at EPOCH", Float, "schedule for this epoch time (seconds)") { |v| at = v }
  o.on("--bulk N", Integer, "push_bulk N jobs with args [i]") { |v| bulk = v }
  o.on("--retry N", Integer, "the payload's retry option (0: a failure goes to dead)") { |v| retry_option = v }
end
positional = parser.parse(ARGV)
abort(parser.banner) unless positional.size == 3
klass, queue, args_json = positional
abort("REDIS_URL is not set") unless ENV["REDIS_URL"]

if bulk
  item = {"class" => klass, "queue" => queue, "args" => (0...bulk).map { |i| [i] }}
  item["at"] = at if at
  puts Sidekiq::Client.push_bulk(item)
else
  args = JSON.parse(args_json)
  abort("ARGS_JSON must be a JSON array") unless args.is_a?(Array)
  item = {"class" => klass, "queue" => queue, "args" => args}
  item["at"] = at if at
  item["retry"] = retry_option unless retry_option.nil?
  jid = Sidekiq::Client.push(item)
  abort("push returned no jid (a client middleware stopped it?)") unless jid
  puts jid
end

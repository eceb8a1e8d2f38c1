"""Prose written for starqa's evaluation haystacks: short essays on unrelated subjects.

Plain text on purpose: no digits (number needles stay unique), no hyphens (word keys are
hyphenated), and none of the phrases the needles and questions use. Each entry is one
paragraph; `generators` draws them in seeded orders and cuts them into sentences.
"""

PARAGRAPHS: tuple[str, ...] = (
    "A lighthouse keeper's working day began at dusk. He climbed the spiral stairs with a can "
    "of oil, trimmed the wick, polished the great lens until no smear could catch the light, "
    "and wound the clockwork that turned it. Through the night he woke every few hours to "
    "check the flame, because a lamp that guttered out could cost a ship and every soul on "
    "it. The logbook on his desk recorded the weather, the passing vessels and the hours the "
    "light had burned. Most entries are dull, and that dullness is the record of a job done "
    "well. When electricity and automatic switches arrived, the keepers left one by one, and "
    "the towers that once held families now stand empty above the rocks.",

    "Sourdough bread depends on a culture of wild yeast and bacteria that the baker keeps "
    "alive for years. Each day a little of the old starter is mixed with fresh flour and "
    "water, and by the next morning it has risen and fallen again, smelling faintly of apples "
    "and vinegar. The bacteria make the acids that give the loaf its sour taste and help it "
    "keep; the yeast makes the gas that lifts it. A slow rise in a cool kitchen brings out "
    "more flavour than a fast one in a warm room. Bakers argue endlessly about hydration, "
    "folding and scoring, but they agree on one thing: the starter rewards patience and "
    "punishes neglect.",

    "Rivers rarely run straight for long. Water moving around a bend flows faster on the "
    "outside, cutting into the bank, and slower on the inside, where it drops sand and "
    "gravel. Over the years the bend grows deeper and wider until the river swings in great "
    "loops across its valley. Sometimes, in a flood, the water breaks through the narrow neck "
    "of a loop and takes the shorter path, leaving behind a curved lake shaped like a crescent "
    "moon. Seen from a hill or an aeroplane, an old floodplain is a tangle of such scars, a "
    "map of every course the river has tried and abandoned.",

    "Before railways, every town kept its own time, set by the sun at noon. A traveller riding "
    "east would find the church clocks slightly ahead of his watch in each new town, and "
    "nobody minded, because nobody moved fast enough for it to matter. The railway changed "
    "that. A timetable is useless if every station reads a different hour, so the companies "
    "agreed on a common time and sent it down the telegraph wires. Towns that resisted soon "
    "found their clocks showing two times at once, one for the trains and one for the sun, "
    "until the sun lost the argument.",

    "A honeybee colony behaves like a single animal spread over many bodies. The queen lays "
    "the eggs, the workers do everything else, and their jobs change as they age: cleaning "
    "cells, feeding larvae, building comb, guarding the entrance and finally flying out to "
    "forage. A forager that finds a good patch of flowers returns and dances on the comb, and "
    "the angle of the dance tells her sisters the direction of the flowers relative to the "
    "sun, while its length tells them the distance. In winter the bees cluster tightly around "
    "the queen, shivering their wing muscles to keep the centre of the cluster warm.",

    "The reading room of an old library is a place designed for quiet. High windows let in "
    "daylight without glare, long tables give each reader a lamp and a little territory, and "
    "the walls are lined with books that most visitors never touch. The catalogue, once a "
    "forest of small wooden drawers full of cards, now lives on a screen, but the logic is the "
    "same: every book has an address, and a book put back in the wrong place is as good as "
    "lost. Librarians say the hardest part of the job is not finding books but persuading "
    "people that the answer they want has already been written down somewhere.",

    "Mapmakers have always had to decide what to leave out. A map that showed everything "
    "would be as large as the land itself and just as hard to read. So the cartographer "
    "chooses: roads but not footpaths, towns but not farms, the outline of a coast smoothed "
    "into a few confident curves. Every projection of the round earth onto flat paper "
    "distorts something, whether areas, angles or distances, and the choice of projection is "
    "a choice about which distortion the reader can live with. A good map is honest about its "
    "compromises and useful despite them.",

    "The tide is the slow breathing of the sea. Twice a day the water climbs the beach and "
    "twice a day it withdraws, pulled by the moon and, more weakly, by the sun. When the two "
    "pull in line, the tides run high and low; when they pull at right angles, the range is "
    "small. Harbours in narrow bays can see the water rise by the height of a house, while "
    "some inland seas barely notice the moon at all. Fishermen, sailors and people who gather "
    "shellfish on the flats all carry tide tables in their heads, and the careless ones learn "
    "the schedule the hard way.",

    "A suspension bridge hangs its road from cables draped between tall towers, and the "
    "cables are anchored in massive blocks of concrete at either end. The design lets "
    "engineers span distances that no arch or beam could cross. It also brings new dangers. "
    "Wind blowing across a long, light deck can set it twisting, and if the twisting matches "
    "the natural rhythm of the structure, each gust adds to the last. Engineers learned this "
    "lesson from a famous collapse, and modern decks are stiffened, shaped like aircraft wings "
    "and tested in wind tunnels before a single cable is strung.",

    "A winter garden looks asleep, but a great deal is happening below the surface. Bulbs "
    "planted in autumn are growing roots in the cold soil, waiting for the lengthening days "
    "that will send up their leaves. Seeds of many wild plants will not sprout until they "
    "have been chilled for weeks, a precaution against germinating in a warm spell only to "
    "be killed by the next frost. The gardener's work in winter is mostly planning: ordering "
    "seeds, sharpening tools, pruning fruit trees while their branches are bare and the shape "
    "of the tree is easy to see.",

    "The mechanical typewriter was a machine of levers and springs. Pressing a key swung a "
    "typebar up against an inked ribbon, which struck the paper wrapped around a rubber "
    "roller, and the carriage slid one step to the left. At the end of a line a bell rang, "
    "and the typist pushed the carriage back with a lever that also turned the roller. Fast "
    "typists jammed the bars together, which is one story told about why the keyboard layout "
    "spreads common letter pairs across the hands. Whatever the truth of that story, the "
    "layout outlived the machines by many decades.",

    "Night trains have a romance that daytime travel lacks. The passenger boards in the "
    "evening, finds a narrow berth behind a sliding door, and falls asleep to the rhythm of "
    "the wheels on the rails. In the small hours the train stops at stations whose names "
    "nobody will remember, where a single lamp shines on an empty platform and a guard walks "
    "the length of the cars. Morning arrives in another country, with different bread at "
    "breakfast and different voices on the platform, and the journey that would have taken a "
    "day of driving has passed in one long sleep.",

    "High in the mountains, a hut offers shelter to walkers crossing the passes. The walls are "
    "thick stone, the windows small, and the roof weighted against the wind. Inside there is "
    "a stove, a long table, bunks stacked three high and a book in which every visitor writes "
    "a name, a route and a few words about the weather. Reading old entries on a stormy "
    "evening, one finds the same complaints and the same joys repeated across generations: "
    "blisters, fog, a bowl of hot soup, and a sunrise over the glacier that made the whole "
    "climb worthwhile.",

    "Salt was once valuable enough to fight over. It preserves meat and fish through the "
    "winter, and before refrigeration that could decide whether a town survived until spring. "
    "Coastal people boiled seawater in iron pans or let the sun evaporate it in shallow ponds; "
    "inland, miners dug rock salt from deep underground or pumped brine from springs. Roads "
    "built to carry salt became trade routes for everything else, and cities grew where they "
    "crossed. Today salt is so cheap that it is scattered on winter roads, and few people "
    "remember that it once paid soldiers and filled treasuries.",

    "Paper was made by hand for most of its history. Rags of linen and cotton were soaked, "
    "beaten into a pulp of loose fibres, and stirred into a vat of water. The papermaker "
    "dipped a fine mesh screen into the vat, lifted it out level, and shook it gently so the "
    "fibres settled and knitted together as the water drained. The wet sheet was pressed onto "
    "felt, stacked with others, squeezed and hung to dry. A watermark, a design woven into the "
    "screen, left a thinner patch in every sheet, visible when held up to the light, which "
    "told buyers which mill had made it.",

    "Glassblowers work at the edge of what a material allows. Molten glass is gathered from "
    "the furnace on the end of a hollow pipe, glowing and soft as honey. The blower turns the "
    "pipe constantly so the gather does not sag, breathes into it to form a bubble, and shapes "
    "it with wooden blocks, wet newspaper and metal tools. Reheating keeps it workable; "
    "cooling too fast would crack it. A finished piece spends a night in an annealing oven, "
    "cooling slowly so that stresses frozen into the glass can relax before they shatter it "
    "on a cold morning.",

    "The bicycle is one of the most efficient machines ever built. A rider on a good road uses "
    "less energy per mile than a walker, and far less than any car. The design settled early: "
    "two wheels of equal size, a chain driving the rear wheel, a diamond frame of tubes. Later "
    "changes, such as gears, better brakes and lighter metals, refined it without altering "
    "the idea. Cities that build safe lanes for cycling find that people use them, and the "
    "streets become quieter, cleaner and more pleasant for everyone, including the drivers "
    "who remain.",

    "Wool has kept people warm for thousands of years. The fibres are crimped, so they trap "
    "air between them, and they can absorb a great deal of moisture before they feel wet. "
    "After shearing, the fleece is washed to remove grease and dirt, carded to align the "
    "fibres, and spun into yarn. Knitters and weavers then turn the yarn into cloth, each "
    "craft with its own tools and traditions. A well made sweater can last for decades, and "
    "when it finally wears through at the elbows, it can be darned, unravelled and knitted "
    "again into something new.",

    "Ferns are older than flowers. They spread across the earth long before the first "
    "blossom opened, and they still reproduce the ancient way, with spores rather than seeds. "
    "On the underside of a fern frond are rows of small brown dots, each a cluster of spore "
    "cases that will burst in dry weather and release dust finer than flour. A spore that "
    "lands somewhere damp grows into a tiny, heart shaped plant that few people ever notice, "
    "and only from that plant does a new fern grow. The curled young fronds, unrolling in "
    "spring, look like the scroll of a violin.",

    "Letters used to travel slowly, and people wrote accordingly. A letter was composed with "
    "care, because it might take weeks to arrive and weeks more for a reply to come back. "
    "Writers described their days in detail, copied out poems, pressed flowers between the "
    "pages and apologised for the length. Historians treasure these collections, because they "
    "record ordinary lives that no official document bothered with. Our own messages are "
    "faster and far more numerous, but most of them vanish, and future historians may find "
    "our age strangely silent.",

    "An observatory on a mountain top is built to escape the air. Every layer of atmosphere "
    "between a telescope and the stars blurs the image, so astronomers climb as high as they "
    "can and choose sites where the air is dry and still. They also flee the light of cities, "
    "which washes out faint galaxies. The domes open at dusk, the telescopes swing silently "
    "to their targets, and the night is spent watching screens in a warm control room rather "
    "than peering through an eyepiece in the cold. The romance has changed, but the sky is the "
    "same.",

    "A market square wakes before the town does. Traders arrive in the dark with vans full of "
    "vegetables, cheese, fish packed in ice and flowers wrapped in wet paper. Stalls go up, "
    "awnings are unrolled, and the first customers are other traders buying breakfast. By mid "
    "morning the square is loud with bargaining and the smell of roasting nuts. The best "
    "stalls are the ones with regulars, people who have bought their eggs from the same "
    "family for twenty years and would no sooner change than move house.",

    "Flying a kite is a lesson in the invisible. The wind cannot be seen, only felt and "
    "inferred from the trees, the grass and the way the kite tugs at the line. A kite rises "
    "because it is held at an angle to the moving air, which pushes it up and back; the line "
    "keeps it from blowing away, and the tail keeps it from spinning. On a gusty day the kite "
    "swoops and dives, and on a steady one it hangs almost motionless, a bright shape pinned "
    "against the clouds.",

    "Rain begins as tiny droplets, far too small to fall, condensing on specks of dust and salt "
    "in a rising cloud. They collide and merge, and in cold clouds ice crystals grow at the "
    "expense of the droplets around them, until the drops or flakes are heavy enough to fall. "
    "Most rain that reaches the ground in temperate lands started as snow high above and "
    "melted on the way down. The smell of rain on dry earth comes from oils released by "
    "plants and from chemicals made by bacteria in the soil, and people are remarkably "
    "sensitive to it.",

    "Archives are where institutions keep their memory. Boxes of letters, minutes of "
    "meetings, ledgers, plans and photographs sit on rolling shelves in cool, dry rooms. An "
    "archivist's task is partly to preserve and partly to choose, because no organisation can "
    "keep everything, and what is thrown away today cannot be consulted tomorrow. Researchers "
    "who visit an archive learn to read old handwriting, to follow a reference from one box to "
    "another, and to accept that the document they most want was probably never kept.",

    "An orchard is a long bet. An apple tree planted today may not bear a useful crop for "
    "several years and may go on bearing for half a century. Most fruit trees are grafted: a "
    "shoot of the desired variety is joined to the roots of another tree chosen for its vigour "
    "or its resistance to disease. Seeds from a good apple rarely grow into trees with good "
    "apples, so every named variety is a clone, kept alive by grafting for generations. In "
    "spring the orchard is white and pink with blossom, and the grower watches the weather, "
    "fearing a late frost.",

    "Caves form where water dissolves rock. Rain picks up a little acid from the air and the "
    "soil, seeps into cracks in limestone, and over long ages widens them into passages and "
    "chambers. Where water drips from the ceiling, it leaves behind a trace of mineral, and "
    "drop by drop the deposits grow into hanging icicles of stone and rising columns from the "
    "floor. Caves keep a nearly constant temperature all year, cool in summer and mild in "
    "winter, which is why people have used them for shelter, storage and the aging of cheese.",

    "A violin is a box of thin wood under great tension. The strings press down on the bridge, "
    "which passes their vibrations to the top plate, and a small post inside, wedged between "
    "top and back, spreads them through the whole body. The varnish, the thickness of the "
    "plates and the shape of the arching all affect the sound, and makers have spent centuries "
    "trying to understand what made the old masters' instruments so good. Players tend to say "
    "that a violin improves with playing, as if the wood learns the music.",

    "Ice on a lake forms from the top down, because water is densest a little above freezing "
    "and sinks, leaving the coldest water at the surface. The first thin skin is clear and "
    "black, and it sings and cracks as it thickens in the cold. Skaters learn to judge it by "
    "its colour and its sound, and wise ones carry spikes and a rope. Under the ice, fish "
    "move slowly in the dark, and the water stays liquid all winter, which is why lakes in "
    "cold countries remain alive while their surfaces are frozen hard.",

    "Moss grows where little else can. It has no true roots, only thin threads that anchor it, "
    "and it drinks through its leaves, so it can live on bare rock, roofs and the bark of "
    "trees. In a drought it dries out and seems dead, then turns green again within hours of "
    "rain. Moss holds water like a sponge, slowing the runoff on hillsides and keeping forest "
    "floors damp. Gardeners who fight it in their lawns might do better to let it win; a moss "
    "garden needs no mowing and stays green through the grey months.",

    "A working harbour is a crowded place. Fishing boats tie up along one quay, ferries at "
    "another, and cranes unload containers at the deep water berths. Pilots guide large ships "
    "through the channel, tugs push them gently against the quay, and harbour masters keep "
    "track of who is where. Everything depends on the tide, the weather and the skill of the "
    "people handling ropes thick as a wrist. At night the harbour lights come on, red on one "
    "side of the entrance and green on the other, and the gulls finally go quiet.",

    "Islands shape the life that reaches them. Animals that arrive by swimming, flying or "
    "drifting on rafts of vegetation find few competitors and many empty roles, and over "
    "generations they change to fill them. Birds lose the power of flight when there are no "
    "predators to escape, and small animals sometimes grow large while large ones shrink. "
    "Naturalists who visited remote islands found creatures seen nowhere else on earth, and "
    "the puzzle of how they came to be there helped to shape the theory of evolution.",

    "Church bells were once the loudest sound most people ever heard. They rang the hours, "
    "called people to services, warned of fire and celebrated weddings, and their sound "
    "carried for miles across quiet fields. Bell founders cast them in pits dug beside the "
    "church, pouring bronze into a mould of clay, and the tone of a bell depends on its shape "
    "and the thickness of its walls. Ringers in some traditions do not play tunes but ring "
    "long mathematical sequences, changing the order of the bells on every pull.",

    "Stairs are a small piece of architecture that everyone uses without thinking. Builders "
    "follow an old rule linking the height of each step to its depth, because a staircase that "
    "breaks it feels wrong at once, even to people who could not say why. Grand staircases in "
    "palaces were designed for display, with shallow steps that forced a slow and dignified "
    "climb. Spiral stairs in castle towers turned in the direction that favoured a defender "
    "coming down over an attacker coming up, or so the guides like to say.",

    "Ink has been made from soot, from oak galls, from the fluid of squid and from crushed "
    "minerals. Iron gall ink, brewed from the swellings that wasps cause on oak trees, was the "
    "standard for centuries; it flows well and darkens on the page, but over time its acid can "
    "eat through the paper, so that old manuscripts sometimes have their letters cut out as if "
    "by a blade. Conservators now spend careful hours stabilising such documents. Modern inks "
    "are more stable, though few of them have the deep brown glow of the old ones.",

    "A good soup begins long before anything goes into the pot. Bones are roasted, vegetables "
    "chopped, herbs tied into a bundle, and the stock simmers for hours without boiling, so "
    "that it stays clear. Cooks in every culture have their own version: a clear broth with "
    "noodles, a thick stew of beans, a cold soup of tomatoes and cucumbers for a hot day. Soup "
    "is forgiving, cheap and kind to leftovers, which is why it has fed more people through "
    "hard winters than almost any other dish.",

    "Potters shape clay on a wheel that spins at a steady pace while their hands, wet and "
    "steady, pull the walls upward. The clay must be centred first, pressed into a perfectly "
    "balanced mound, or the pot will wobble and tear. After drying, the pot is fired once, "
    "coated with glaze and fired again at a higher temperature, when the glaze melts into a "
    "glassy skin. The kiln is the final judge, and potters open it with a mixture of hope and "
    "dread, because the fire can produce colours nobody intended, some ruined and some "
    "beautiful.",

    "Fog forms when moist air cools until it can no longer hold its water as vapour. On clear "
    "autumn nights the ground loses heat to the sky, chilling the air above it, and by dawn the "
    "valleys are filled with white. Along some coasts, warm ocean air drifts over cold water "
    "and rolls inland as a grey wall. Fog muffles sound and erases distance, so that a "
    "familiar street becomes mysterious and a foghorn's low note seems to come from "
    "everywhere at once. Sailors fear it more than storms.",

    "Owls hunt by ear as much as by eye. Their faces are shaped like dishes that gather sound, "
    "and in some species one ear sits higher than the other, so the bird can tell whether a "
    "rustle comes from above or below. The edges of their wing feathers are soft and fringed, "
    "breaking up the air so that they fly almost without a sound. A mouse under the snow, "
    "heard but not seen, can be caught with a single plunge. By day owls sleep in hollow trees "
    "or dense foliage, and small birds that find one will mob it noisily until it leaves.",

    "Deserts are not empty. Plants there store water in swollen stems, shed their leaves in "
    "the dry season or lie dormant as seeds for years until a rare storm wakes them, and then "
    "the sand is covered in flowers for a few weeks. Animals hide from the heat in burrows by "
    "day and come out at night, and many never drink at all, getting all their water from "
    "their food. The cold is as hard as the heat: with no clouds to hold the warmth, desert "
    "nights can be bitterly cold.",

    "A coral reef is built by animals smaller than a fingernail. Each polyp lays down a cup of "
    "limestone beneath itself, and over centuries the cups add up to walls and towers that "
    "shelter an astonishing variety of fish, crabs, worms and shellfish. The polyps share "
    "their bodies with algae that turn sunlight into food, which is why reefs grow only in "
    "clear, shallow, warm water. When the water gets too hot, the polyps expel the algae and "
    "turn white, and unless the heat passes quickly they starve.",

    "Windmills once ground grain across the flat lands of northern Europe and pumped water out "
    "of fields that lay below the level of the sea. The miller turned the whole cap of the "
    "mill to face the wind, set the cloth on the sails according to its strength, and listened "
    "to the stones for signs that the grain was running out. A mill left running empty could "
    "strike sparks and burn. Modern wind turbines owe little to the old designs, but they stand "
    "in the same places for the same reason: the wind there is steady and strong.",

    "Canals were the motorways of the early industrial age. A single horse walking along a "
    "towpath could pull a boat carrying many times the load it could drag on a road, and "
    "factories grew up along the water to take advantage. Locks carried the boats up and down "
    "hills, each a chamber with gates at both ends, filled or emptied to raise or lower the "
    "water. When the railways came, most canals fell into decline, and many lay silted and "
    "forgotten until people rediscovered them as places for slow holidays and quiet walks.",

    "Weaving interlaces two sets of threads at right angles. The warp is stretched on the "
    "loom, and the weft is passed over and under it, row after row, with a shuttle. Raising "
    "different warp threads for each pass creates patterns, from the plain over and under of "
    "simple cloth to intricate twills and brocades. Some looms were controlled by chains of "
    "punched cards, each card deciding which threads to lift, and that idea of storing "
    "instructions as holes in card later found its way into the first calculating machines.",

    "Chess has been played for well over a thousand years, and the rules have changed along "
    "the way. The queen was once a weak piece that moved one square diagonally; she became the "
    "most powerful on the board only in the late middle ages, and the game grew faster and "
    "more aggressive as a result. Players study openings that have been analysed for "
    "centuries, yet a game of chess still leaves the known paths after a dozen moves, and "
    "from there each player is alone with the position.",

    "A stone quarry leaves a hole that outlasts the town that dug it. Workers split blocks from "
    "the rock face with wedges, drills and, later, explosives, and hauled them away for "
    "churches, bridges and houses whose walls still show the marks of the tools. When a quarry "
    "closes, the pit often fills with rainwater and becomes a deep, cold lake with sheer sides. "
    "Climbers use the old walls, divers explore the flooded machinery, and rare plants colonise "
    "the thin soil on the ledges.",

    "Clockmakers of the eighteenth century pursued a prize for a clock that could keep time "
    "at sea. A navigator who knew the time at home and the local time from the sun could "
    "work out how far east or west the ship had sailed, but pendulum clocks failed on a "
    "rolling deck, and every small error became many miles of uncertainty. The winning design "
    "used springs and balances that compensated for heat and cold, and it took its maker most "
    "of his life to perfect. Ships' clocks of that kind guided fleets until radio time signals "
    "made them unnecessary.",

    "Snow is a good insulator. A thick layer on a field keeps the soil beneath it far warmer "
    "than the air above, protecting roots and hibernating animals from the deepest cold. Mice "
    "and voles live all winter in tunnels at the base of the snow, safe from most predators "
    "and close to the seeds and grasses they eat. People who travel in cold mountains dig "
    "shelters in snowdrifts for the same reason, and a well made snow cave, lit by a single "
    "candle, can be surprisingly comfortable while a storm blows overhead.",

    "Printing with movable type turned books from rare treasures into ordinary objects. A "
    "printer set each line letter by letter from a case of small metal blocks, locked the "
    "lines into a frame, inked them and pressed paper against them. After printing, the "
    "letters were cleaned and sorted back into the case for the next job. The upper case held "
    "the capitals and the lower case the small letters, which is where the names come from. "
    "Within a lifetime of the first press, printed books numbered in the millions.",

    "Rope is made by twisting fibres into yarns, yarns into strands and strands into the rope "
    "itself, each twist in the opposite direction to the one before, so the whole holds "
    "together instead of unravelling. Old ropewalks were long, narrow buildings, sometimes "
    "longer than a street, because the strands had to be laid out at full length before they "
    "were twisted. Sailors learned dozens of knots, each for a particular job, and a knot that "
    "holds under strain yet can be untied easily afterwards is still prized above all others.",
)

# Filler of the noise haystack (RULER's), repeated as many times as the length needs.
NOISE = ("The grass is green. The sky is blue. The sun is yellow. Here we go. "
         "There and back again.")
